"""One context-budget rule for the planner, the guard, the engine, the session and captioning:
the plan's image count is what the engine then admits."""

from __future__ import annotations

import numpy as np
import pytest

import edgevlm
from edgevlm.caption import CaptionSettings, caption_slots
from edgevlm.errors import InputError
from edgevlm.plan.context import TEXT_ROOM_MAX, TEXT_ROOM_MIN, ContextBudget
from edgevlm.plan.devices import probe
from edgevlm.plan.planner import Wishes, make_plan
from edgevlm.vision.images import from_rgb


def pictures(n, seed=0):
    rng = np.random.default_rng(seed)
    return [from_rgb((rng.random((200, 260, 3)) * 255).astype(np.uint8), f"p{i}.png") for i in range(n)]


def test_the_rule():
    big, small = ContextBudget(8192), ContextBudget(1536)
    assert big.text_room == TEXT_ROOM_MAX and ContextBudget(256).text_room == TEXT_ROOM_MIN
    assert small.text_room == 1536 // 8
    assert big.reply_reserve(512) == 512 and small.reply_reserve(512) == 384  # at most a quarter
    assert big.image_room(512) == 8192 - 512 - 512
    assert big.images_that_fit(576, 512) == (8192 - 1024) // 576
    assert big.images_that_fit(0, 512) == 0
    assert ContextBudget.min_ctx(5, 576, 512) == 5 * 576 + 512 + 512
    assert (
        big.images_that_fit(576, 512) >= 5
        and ContextBudget(ContextBudget.min_ctx(5, 576, 512)).images_that_fit(576, 512) == 5
    )
    # captioning: each prompt needs its picture, its instruction and its reply; the system prompt is shared
    assert big.prompts_in_flight(576, 128, 32, 4) == 4 and ContextBudget(1024).prompts_in_flight(576, 128, 32, 4) == 1
    assert caption_slots(2048, 576, CaptionSettings(max_tokens=128)) == 2


@pytest.mark.parametrize("n_ctx,reply", [(4096, 16), (2048, 48), (1536, 8)])
def test_the_plan_image_count_is_what_the_engine_admits(model_pair, n_ctx, reply):
    pair = model_pair("llava15")
    plan = make_plan(str(pair.model), str(pair.mmproj), probe(device="cpu"), Wishes(n_ctx=n_ctx, reply_tokens=reply))
    k = plan.max_images_in_context
    assert k == ContextBudget(plan.n_ctx).images_that_fit(576, reply) >= 2
    assert f"{k} image(s) of 576 tokens fit" in " ".join(plan.reasons)
    pics = pictures(k + 2, seed=n_ctx)
    fail = edgevlm.EngineOptions(session=edgevlm.SessionOptions(enabled=False))
    with edgevlm.load(pair.model, pair.mmproj, plan=plan, options=fail, n_threads=2) as vlm:
        eng = vlm.conversation()
        # one picture per turn, eviction off: exactly k are admitted, the next is refused
        for i in range(k):
            eng.chat(f"Picture {i + 1}?", [pics[i]], max_tokens=reply, temperature=0.0)
        with pytest.raises(InputError, match="left in the context"):
            eng.chat("One more?", [pics[k]], max_tokens=reply, temperature=0.0)
        assert sum(p.in_context for p in eng.pictures) == k
        # all in one message: k fit, k + 1 do not
        eng.reset()
        eng.chat("All of them?", pics[:k], max_tokens=reply, temperature=0.0)
        eng.reset()
        with pytest.raises(InputError, match="left in the context"):
            eng.chat("All of them?", pics[: k + 1], max_tokens=reply, temperature=0.0)
        # with the session on, a conversation keeps at most k pictures and never fails
        keep = vlm.conversation(session=edgevlm.SessionOptions())
        for i, p in enumerate(pics):
            r = keep.chat(f"And picture {i + 1}?", [p], max_tokens=reply, temperature=0.0)
            assert sum(q.in_context for q in keep.pictures) <= k
            assert r.stats.n_ctx_used <= r.stats.n_ctx
        # (long replies and summaries take text room too: at most one more picture gives way)
        assert k - 1 <= sum(q.in_context for q in keep.pictures) <= k and keep.summaries.generated >= 2

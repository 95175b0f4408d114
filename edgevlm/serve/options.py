"""How the server runs, fixed when it is made."""

from __future__ import annotations

from dataclasses import dataclass

from ..backend.sampling import SERVE_REPLY, SamplingParams
from ..plan.context import IN_FLIGHT_MAX, ContextBudget
from ..runtime.intake.fetch import FetchRules

__all__ = ["ServeOptions", "serve_layout", "serve_sequences", "serve_slots"]

DEFAULT_PARALLEL = IN_FLIGHT_MAX
MIB = 2**20
LLAMA_MAX_SEQ = 256  # sequence ids llama.cpp gives one context (src/llama-cparams.h)
CELLS_PER_CONVERSATION = 256  # a context keeps a conversation per this many cells


@dataclass(frozen=True)
class ServeOptions:
    model_id: str = "edgevlm"  # the name /v1/models lists (any name is accepted in requests)
    api_key: str | None = None  # Bearer token every /v1 route asks for (None: open)
    # a second port on the same host answering Ollama's API alone (/api/chat, /api/generate, /api/tags
    # ... and "/": "Ollama is running"), as Ollama's 11434 does; None: /api/... on the main port only
    ollama_port: int | None = None
    queue: int = 16  # requests that may wait for a free sequence; more get 503 + Retry-After
    max_body_bytes: int = 32 * 2**20  # a larger request body gets 413
    # a body must arrive within body_timeout_s plus 1 s per body_min_rate bytes that came (never
    # past timeout_s), else 408 and its lease is given back (http.BodyPace). It holds host
    # allowance for its whole Content-Length before its first byte is read, and takes a place
    # (the queue) only once it is all in: a slow body never holds the door
    body_timeout_s: float = 20.0
    body_min_rate: int = 16 * 1024  # bytes a second
    chunked_body_bytes: int = 2**20  # a body without a Content-Length (chunked) may hold this much; more: 413
    # a connection sends its request line and headers within this many seconds of opening (or of
    # its last response), else it is closed: a socket that trickles headers holds nothing for long
    header_timeout_s: float = 10.0
    max_tokens: int = SERVE_REPLY.max_tokens  # replies of requests that name no max_tokens
    sampling: SamplingParams = SERVE_REPLY.sampling  # how requests that name no temperature, top_k ... sample
    timeout_s: float = 600.0  # a request ends after this long (waiting included)
    # on SIGTERM / Ctrl-C, replies in progress get this long to finish, then end with their last
    # event (finish "length", a notice); waiting requests get 503 at once (docs/serve.md, Stopping)
    shutdown_grace_s: float = 5.0
    retry_after_s: int = 2  # what a 503 tells clients to wait
    # where a request's pictures may come from, and a fetch's limits: ``FetchRules`` (its defaults)
    allow_private_urls: bool = FetchRules.allow_private_urls
    allow_paths: tuple[str, ...] = ()  # folders whose files a request may name as images (none)
    path_base: str | None = None  # relative image paths are read from here (None: the current folder)
    url_max_bytes: int = FetchRules.url_max_bytes
    url_timeout_s: float = FetchRules.url_timeout_s
    url_deadline_s: float = FetchRules.url_deadline_s
    url_min_rate: int = FetchRules.url_min_rate
    url_fetches: int = FetchRules.url_fetches
    url_fetches_per_request: int = FetchRules.url_fetches_per_request
    url_max_redirects: int = FetchRules.url_max_redirects
    # host RAM requests in flight and waiting may hold (bodies, decodes, views, embeddings): the
    # plan's --host-allowance when serving; a 24-megapixel photo takes ~190 MiB while decoded
    host_allowance: int = 512 * MIB
    host_wait_s: float = FetchRules.host_wait_s  # a request waits this long for host allowance, then 503
    # a waiting request starts before longer ones (least prompt to evaluate first) unless one of
    # them has waited this long
    fair_wait_s: float = 10.0
    # a follow-up (at most SHORT_PROMPT new cells) starts before new pictures and beside --parallel
    # running requests; False: requests start in arrival order, --parallel at most (batch files:
    # each line meets the KV cache it meets when the server is sent the lines one by one)
    follow_ups_first: bool = True
    stream_interval_s: float = 0.02  # a streamed reply's text goes out at most this often (tokens joined)
    # host RAM for idle conversations moved out of the KV cache, copied back when they return
    # (the plan's --cache-ram when serving)
    cache_ram: int = 1024 * MIB
    # a folder those pushed out of RAM go to, kept across restarts (None: none), and its bound
    cache_dir: str | None = None
    cache_disk: int = 8 * 1024 * MIB
    # /v1/responses kept in memory for previous_response_id and GET /v1/responses/{id} (least
    # recently used given up first): at most this many, holding at most this many bytes (their
    # texts and picture URLs — a data URI is the picture's bytes in base64 — never pixels)
    responses_store: int = 256
    responses_store_bytes: int = 64 * MIB
    # most tokens a thinking model's <think> block may take before </think> is put in (as
    # llama-server's --reasoning-budget): -1 no cap, 0 no reasoning (the template's switch, or the
    # block closed at once); a request's own budget (Anthropic's thinking.budget_tokens) is kept under it
    reasoning_budget: int = -1

    @property
    def fetch_rules(self) -> FetchRules:
        """Where a request's pictures may come from, and a fetch's limits (the intake's)."""
        return FetchRules(
            allow_private_urls=self.allow_private_urls,
            allow_paths=self.allow_paths,
            path_base=self.path_base,
            url_max_bytes=self.url_max_bytes,
            url_timeout_s=self.url_timeout_s,
            url_deadline_s=self.url_deadline_s,
            url_min_rate=self.url_min_rate,
            url_fetches=self.url_fetches,
            url_fetches_per_request=self.url_fetches_per_request,
            url_max_redirects=self.url_max_redirects,
            timeout_s=self.timeout_s,
            host_wait_s=self.host_wait_s,
        )


def serve_slots(n_ctx: int, image_max_tokens: int | None, max_tokens: int, parallel: int | None = None) -> int:
    """Sequences for a server (or batch file) on a context of ``n_ctx``: ``parallel``, or as
    many one-picture requests with a ``max_tokens`` reply as fit, up to ``DEFAULT_PARALLEL``."""
    if parallel:
        return parallel
    return ContextBudget(n_ctx).prompts_in_flight(
        image_max_tokens or 576, max_tokens, ContextBudget.shared_prefix(None), DEFAULT_PARALLEL
    )


def serve_sequences(n_ctx: int, parallel: int) -> int:
    """Sequence ids for a server: conversations kept in the KV cache, many more than the
    requests that generate at once — one per ``CELLS_PER_CONVERSATION`` cells of context, at
    least ``parallel``, at most llama.cpp's limit."""
    return max(parallel, min(LLAMA_MAX_SEQ, n_ctx // CELLS_PER_CONVERSATION))


def serve_layout(
    n_ctx: int, image_max_tokens: int | None, max_tokens: int, parallel: int | None = None, most: int = LLAMA_MAX_SEQ
) -> tuple[int, int]:
    """(sequence ids, requests generating at once) for a server or a batch file on a context of
    ``n_ctx``: the same layout everywhere, so a request meets the same KV cache however it came
    (``most``: the sequences the plan counted the output buffer for)."""
    slots = serve_slots(n_ctx, image_max_tokens, max_tokens, parallel)
    return min(most, serve_sequences(n_ctx, slots)), slots

"""One intake for every caller: a picture, a clip or a recording, from wherever it comes, made
into the budgeted, guarded views a turn sends, and the turn itself (``turn``: the one shape
every caller builds and the runtime takes). Chat (``Engine``), the server (``ChatService`` and
the budget route), captioning, batch files and ``edgevlm budget`` all go through here: this is
the one place that budgets a picture, plans a clip or cuts a recording.

    intake = vlm.intake()                                   # a LoadedModel's, or Intake(proj, budget, ...)
    made, used = intake.message([MediaRef("photo.jpg"), MediaRef("clip.mp4")], room)
    intake.views(MediaRef(data, detail="low"), room).to_dict()   # what the budget views show

What is decided here, once:
- **what a source is** (``media_kind``): the kind the caller states (an API's part type), else
  a path's extension or content, else the bytes' content (animated GIF/WebP are clips);
- **where its bytes come from**: a string is read by the caller's ``FetchRules`` (``fetch``):
  ``data:`` URIs, http(s) URLs (on the fetch threads, by their deadlines, held on the request's
  lease as they arrive), files (a caller's own: any; a server's: under ``--allow-path``);
- **its budget**: the per-picture budget and tiles of the options, or for ``detail: "low"``
  ``LOW_DETAIL_TOKENS`` without tiles (``budget_for``);
- **a clip's frames**: pictures first, then the clips of a message share the room the pictures
  leave, each an equal part (``message``), its frames chosen by ``vision.video.plan_video``;
- **a recording's pieces**: decoded as a stream by ``audio.plan_audio``, long silences dropped,
  packed into encoder windows each labelled with its times, cut to the room it shares with the
  message's clips; a model without an audio encoder refuses it (one without a vision encoder
  refuses pictures);
- **what it is remembered by** (its summary key): a picture's pixel hash, a clip's or a
  recording's file hash;
- **what it holds**: views larger than the encoder needs are kept small (``compact_view``);
  under a ``Lease`` the compressed bytes, the decode's peak and the views are taken before they
  are held and given back when dropped;
- **the guard**: each view past ``Guard.admit`` against the image room left (``admit``).
"""

from __future__ import annotations

from .fetch import Fetcher, FetchRules, url_scheme
from .media import Clip, MediaRef, Sound, file_key, load_media, media_kind, thumbnail_uri
from .turn import Asked, ReplySpec, Turn
from .views import LOW_DETAIL_TOKENS, Admitted, Intake, Views, make_turn

__all__ = [
    "LOW_DETAIL_TOKENS",
    "Admitted",
    "Asked",
    "Clip",
    "FetchRules",
    "Fetcher",
    "Intake",
    "MediaRef",
    "ReplySpec",
    "Turn",
    "Sound",
    "Views",
    "file_key",
    "load_media",
    "make_turn",
    "media_kind",
    "thumbnail_uri",
    "url_scheme",
]

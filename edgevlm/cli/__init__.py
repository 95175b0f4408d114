"""The ``edgevlm`` command: a thin click layer over the library, one module per command.

Each command parses its options, calls the library, formats the result, and turns an
``EdgeVLMError`` into one line on stderr and the error's exit code (never a traceback). This
group imports the commands; no command imports it.
"""

from __future__ import annotations

import click

from .batch import batch
from .budget import budget
from .caption import caption
from .chat import chat
from .doctor import doctor
from .inspect import inspect
from .models import models, pull, rm
from .plan import plan
from .serve import serve

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgevlm")
def main() -> None:
    """Run GGUF vision-language models through llama.cpp, planned to fit in memory."""


for _cmd in (chat, caption, batch, serve, plan, budget, inspect, pull, models, rm, doctor):
    main.add_command(_cmd)

if __name__ == "__main__":  # pragma: no cover
    main()

"""``python -m lightning_antichain`` is the ``lightning-antichain`` command."""

from .cli import main

raise SystemExit(main())

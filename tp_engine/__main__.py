"""`python -m tp_engine`: the generate command line, as launch/generate.py runs it; the entry of the ranks
that tp-generate starts (an installed package has no launch/ folder)."""
import sys

from tp_engine.frontend.lifeline import start_rank

start_rank()  # first: the imports below take seconds (torch), and the launcher may die meanwhile

from tp_engine.cli import main  # noqa: E402

sys.exit(main())

"""`python -m stapo_trl ...` runs the `stapo-trl` command line."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())

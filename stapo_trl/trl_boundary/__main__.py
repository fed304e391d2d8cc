"""`python -m stapo_trl.trl_boundary` prints every drift check against the installed TRL, transformers and vLLM."""

from .drift_checks import main

if __name__ == "__main__":
    main()

"""`python -m glmconv ...` (and `torchrun -m glmconv ...`) runs the CLI."""

from cli.main import main

if __name__ == "__main__":
    main()

"""`python -m glmconv ...` (and `torchrun -m glmconv ...`) runs the CLI."""

from glmconv_cli.main import main

if __name__ == "__main__":
    main()

"""`python -m coral.cli`: the `coral` command."""
from coral.cli import main

if __name__ == "__main__":
    main()

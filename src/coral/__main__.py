"""`python -m coral`: the same command as the `coral` script."""
from coral.cli import main

main(prog_name="coral")

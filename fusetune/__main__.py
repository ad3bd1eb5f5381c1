"""`python -m fusetune ...`: the `fusetune` command where its console script is not installed
(the package on PYTHONPATH only)."""

from fusetune.cli import main

# The search's compile and benchmark processes are spawned: each imports this module again as
# __mp_main__, where the command must not run a second time.
if __name__ == "__main__":
    main()

"""``python -m sa_jobqueue.cli``: the same as the ``sa-jobqueue`` command."""

from . import main

if __name__ == "__main__":
    main()

"""``python -m app``: the same as the ``epp`` command."""

from app.cli import main

if __name__ == "__main__":
    main()

"""``python -m moereplay`` runs the command-line interface."""

from moereplay.cli import main

if __name__ == "__main__":
    main()

# SPDX-License-Identifier: MIT
"""``python -m pyattn <command>``: command-line entry points (for now: ``explain``)."""

import sys

USAGE = "usage: python -m pyattn explain [--help | options]"


def main(argv=None):
    """Dispatch a subcommand; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "explain":
        from ._explain import main as explain_main

        return explain_main(argv[1:])
    print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

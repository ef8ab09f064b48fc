"""``make bench``: every benchmark in turn; each writes bench/results/<name>.json."""

from __future__ import annotations

from bench import prepare

if __name__ == "__main__":
    prepare.main()

"""``make bench``: every benchmark in turn; each writes bench/results/<name>.json."""

from __future__ import annotations

from bench import explain, mig, mps, prepare

if __name__ == "__main__":
    explain.main()
    prepare.main()
    mig.main()
    mps.main()

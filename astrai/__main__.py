"""`python -m astrai`: the same command line as `astrai`."""

from astrai.cli import main

raise SystemExit(main())

import sys

from octavo.cli import main

sys.exit(main())

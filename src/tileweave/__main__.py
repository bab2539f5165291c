import sys

from tileweave.cli import main

sys.exit(main())

import sys

from longserve.cli import main

sys.exit(main())

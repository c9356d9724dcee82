import sys

from tndebug.cli import main

sys.exit(main())

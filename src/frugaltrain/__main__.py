import sys

from frugaltrain.cli import main

sys.exit(main())

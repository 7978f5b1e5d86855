import sys

from layershard.cli import main

sys.exit(main())

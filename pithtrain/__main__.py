import sys

from pithtrain.cli import main

sys.exit(main())

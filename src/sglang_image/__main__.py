import sys

from sglang_image.cli import main

sys.exit(main())

"""``python -m drasil.kubeletplugin.gpucheck``: see ``drasil.kubeletplugin.gpucheck.main``."""

import sys

from drasil.kubeletplugin.gpucheck.main import main

sys.exit(main())

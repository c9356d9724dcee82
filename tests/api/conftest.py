import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))        # `import models`
torch.set_num_threads(int(os.environ.get("TNDEBUG_TEST_THREADS", "1")))

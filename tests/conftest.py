import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before any Hugging Face import: nothing is downloaded
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

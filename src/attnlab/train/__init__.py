from attnlab.train.checkpoint import CheckpointError, load_model_from_checkpoint
from attnlab.train.loop import train

__all__ = ["CheckpointError", "load_model_from_checkpoint", "train"]

"""zinf-fn: ZeRO-Infinity as a functional training engine over PyTorch."""

from .config import Config
from .model import Model, Stage, Tie, TokenLoss, plain_loss, token_mean
from .optim.optimizers import Optimizer, adamw, sgd
from .planner import auto_config, calibrate, estimate, plan
from .state import gather_params
from .train import TrainState, close, eval_step, flush, init, train_step

__all__ = [
    "Config",
    "Model",
    "Optimizer",
    "Stage",
    "Tie",
    "TokenLoss",
    "TrainState",
    "adamw",
    "auto_config",
    "calibrate",
    "close",
    "estimate",
    "eval_step",
    "flush",
    "gather_params",
    "init",
    "plain_loss",
    "plan",
    "sgd",
    "token_mean",
    "train_step",
]

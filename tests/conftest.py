"""Shared test set-up: keep torch to one intra-op thread so rank threads do not fight for the
two cores, and make the test models importable."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

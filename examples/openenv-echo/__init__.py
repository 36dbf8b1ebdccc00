# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Echo Env Environment."""

from .client import EchoEnv
from .models import EchoAction, EchoObservation

__all__ = [
    "EchoAction",
    "EchoObservation",
    "EchoEnv",
]

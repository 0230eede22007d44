"""PaddlePaddle backend."""

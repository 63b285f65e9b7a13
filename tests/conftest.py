import gc
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import preload_data  # noqa: E402,F401  (Fashion-MNIST decoded once; forked ranks inherit it)

try:  # torchvision's CUDA-built C++ ops do not load beside the CPU torch; Lightning imports torchvision
    from gradsync.workloads.vision import torchvision_models

    torchvision_models()
except ImportError:
    pass

gc.freeze()  # this worker's collections skip the ~170k objects the imports above made


def pytest_collection_finish(session):
    gc.freeze()  # and those the test modules' imports made (Lightning, Transformers, ...)

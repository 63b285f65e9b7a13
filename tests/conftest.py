import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import preload_data  # noqa: E402,F401  (Fashion-MNIST decoded once; forked ranks inherit it)

try:  # torchvision's CUDA-built C++ ops do not load beside the CPU torch; Lightning imports torchvision
    from gradsync.workloads.vision import torchvision_models

    torchvision_models()
except ImportError:
    pass


#: Test files whose tests run longest (seconds on 2 pytest-xdist workers, 2 cores: train_e2e 118, resume_matrix
#: 99, torchrun_cluster 85, integrations 76, bench_cli 60, bench_quality 51, auto 45, stragglers 42, packaging 34):
#: run first, so that the workers end together on short tests instead of one waiting for the other's last
#: long one (alphabetically most of them come last).
LONG_FIRST = ("test_train_e2e.py", "test_resume_matrix.py", "test_torchrun_cluster.py", "test_integrations.py",
              "test_bench_cli.py", "test_bench_quality.py", "test_auto.py", "test_stragglers.py", "test_packaging.py",
              "test_train_resilience.py", "test_bench_entries.py", "test_covap_auto.py", "test_oscar.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))

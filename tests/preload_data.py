"""Imported by every test process and by ``run_cli``'s forkserver: decodes Fashion-MNIST once
(:func:`gradsync.workloads.fashion_mnist.read_idx` keeps it per process) so the ranks and commands they
fork start with it, as ``gradsync train``'s ranks do from their launcher."""

from gradsync.workloads import fashion_mnist

for _split in ("train", "test"):
    try:
        fashion_mnist.load(None, _split)
    except (FileNotFoundError, ValueError):  # not installed (tests needing it skip) or damaged
        pass

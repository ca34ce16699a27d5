"""Speed, memory and communication benches: the scenario CLI (``benchmark``), the GPU harness (``gpu``) and
the benches it runs, with their shared helpers (``machine``, ``launches``) in files of their own."""

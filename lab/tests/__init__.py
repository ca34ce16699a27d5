"""The lab's tests (pytest collects ``tests`` and ``lab/tests``)."""

"""The test suite. Importing the package (which pytest does before any conftest or test module)
sets OpenMP's wait policy for the tests and every process they start, before torch loads."""

import os

# The suite runs two workers on two cores, each starting servers and commands with threads of
# their own: OpenMP threads spinning at a barrier while their peer waits for a core made every
# step many times slower (docs/testing.md#openmp-wait-policy). A passive wait yields the core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

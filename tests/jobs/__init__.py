"""Scripts that tests launch as separate jobs (under mpirun), and helpers to run them."""

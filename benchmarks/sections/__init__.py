"""The benchmark sections: each module or package here defines `SECTION`."""

"""Context parallelism by state passing: the CP group, the conv's halo and the SSM state carried across slices."""

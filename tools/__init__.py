"""Developer tools of the repository (not shipped in the package)."""

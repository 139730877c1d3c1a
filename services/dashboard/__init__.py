"""History dashboard: past runs drawn the way Dask's live dashboard draws them."""

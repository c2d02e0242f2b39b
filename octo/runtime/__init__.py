"""Where models live: model handles (in process, worker process), the worker and its IPC, the registry that loads,
unloads and supervises models, the loader, the start-up engine selection and the core arbiter."""

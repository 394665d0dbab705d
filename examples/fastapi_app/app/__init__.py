"""A FastAPI app that enqueues on the request's AsyncSession (docs/fastapi.md)."""

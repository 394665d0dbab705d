import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from sa_jobqueue.aio import AsyncWorker

from .db import engine, get_session
from .jobs import emails, send_welcome, tasks
from .models import Base, User


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)  # a real app runs its Alembic migrations instead
    if os.environ.get("WORKER_IN_APP") != "1":
        yield  # the jobs run in worker.py, a process of its own
    else:
        # Small deployments: the jobs run in the web process, on its event loop.
        worker = AsyncWorker(engine, emails, tasks, queues=["signup"], concurrency=10)
        running = asyncio.create_task(worker.run(handle_signals=False))  # uvicorn owns the signals
        yield
        worker.stop()  # hands back what did not start, lets running jobs finish (shutdown_timeout)
        await running
    await engine.dispose()


app = FastAPI(lifespan=lifespan)
SessionDep = Annotated[AsyncSession, Depends(get_session)]


class Signup(BaseModel):
    email: str


@app.post("/signup", status_code=201)
async def signup(body: Signup, session: SessionDep) -> dict[str, int]:
    try:
        async with session.begin():  # the user and the job commit together, or neither does
            user = User(email=body.email)
            session.add(user)
            await session.flush()  # the user's id, and a duplicate email fails here
            job = await send_welcome.enqueue_async(session, user.id)  # checked: send_welcome(user_id: int)
    except IntegrityError:
        raise HTTPException(409, f"{body.email} has signed up already") from None
    return {"user_id": user.id, "job_id": job.id}


@app.get("/users/{user_id}")
async def get_user(user_id: int, session: SessionDep) -> dict[str, object]:
    user = await session.get(User, user_id)
    if user is None:
        raise HTTPException(404, "no such user")
    return {"id": user.id, "email": user.email, "welcomed": user.welcomed}

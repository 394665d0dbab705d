from sqlalchemy.ext.asyncio import AsyncSession

from sa_jobqueue import TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository

from .models import EmailJob, User

emails = AsyncJobRepository(EmailJob)  # the queue verbs, awaited, on an AsyncSession
tasks = TaskRegistry()


@tasks.task
async def send_welcome(job: EmailJob, session: AsyncSession) -> None:
    user = await session.get(User, job.payload["user_id"])
    print(f"sending the welcome email to {user.email}", flush=True)  # at least once: be idempotent
    user.welcomed = True  # commits with the job's completion: exactly once

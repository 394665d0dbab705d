from sqlalchemy.ext.asyncio import AsyncSession

from sa_jobqueue import JobContext, TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository

from .models import EmailJob, User

emails = AsyncJobRepository(EmailJob)  # the queue verbs, awaited, on an AsyncSession
tasks = TaskRegistry(repository=emails)  # its tasks' jobs go to this table


@tasks.task(queue="signup")
async def send_welcome(ctx: JobContext, session: AsyncSession, user_id: int) -> None:
    user = await session.get(User, user_id)
    print(f"job {ctx.id}: sending the welcome email to {user.email}", flush=True)  # at least once: be idempotent
    user.welcomed = True  # commits with the job's completion: exactly once

from sqlalchemy.orm import Session

from sa_jobqueue import TaskRegistry
from sa_jobqueue.aio import AsyncJobRepository

from .models import EmailJob, User

emails = AsyncJobRepository(EmailJob)  # the queue verbs, awaited, on an AsyncSession
tasks = TaskRegistry()


@tasks.task
def send_welcome(job: EmailJob, session: Session) -> None:
    user = session.get(User, job.payload["user_id"])
    print(f"sending the welcome email to {user.email}", flush=True)  # at least once: be idempotent
    user.welcomed = True  # commits with the job's completion: exactly once

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sa_jobqueue import JobMixin


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200), unique=True)
    welcomed: Mapped[bool] = mapped_column(default=False)


class EmailJob(JobMixin, Base):  # the app's own job table
    __tablename__ = "email_jobs"

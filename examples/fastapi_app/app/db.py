import os
from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from sa_jobqueue import psycopg_url

# postgresql+psycopg:// with create_async_engine: psycopg's async driver.
engine = create_async_engine(psycopg_url(os.environ["DATABASE_URL"]))
sessions = async_sessionmaker(engine, expire_on_commit=False)


async def get_session() -> AsyncIterator[AsyncSession]:
    async with sessions() as session:
        yield session

//! Poll mode's background thread: re-reads the repository every interval.

use std::sync::Weak;
use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Repository;
use crate::error::{Result, ServeError};

/// The polling thread; stopped by [`Poller::stop`] (or when the repository is dropped).
#[derive(Debug)]
pub struct Poller {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

impl Poller {
    /// Polls `repository` every `every` until stopped. The thread holds the repository
    /// weakly, so a repository dropped without a shutdown still ends it.
    pub fn start(repository: Weak<Repository>, every: Duration) -> Result<Self> {
        let (stop, stopped) = channel::<()>();
        let thread = std::thread::Builder::new()
            .name("repository-poll".into())
            .spawn(move || {
                loop {
                    match stopped.recv_timeout(every) {
                        Err(RecvTimeoutError::Timeout) => {}
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                    let Some(repository) = repository.upgrade() else {
                        return;
                    };
                    repository.poll();
                }
            })
            .map_err(ServeError::Io)?;
        Ok(Poller { stop, thread })
    }

    /// Stops polling and waits for a poll in progress to finish.
    pub fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

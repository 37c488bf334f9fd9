//! A bounded multi-producer multi-consumer queue: the stages' hand-off points.
//!
//! `try_push` never blocks: a full queue is the server's overload signal and becomes an
//! explicit rejection, so a burst cannot grow memory without bound or hang a client.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// Why an item was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum PushError {
    /// At capacity.
    Full,
    /// Closed for shutdown.
    Closed,
}

/// Bounded FIFO shared by producer and consumer threads.
#[derive(Debug)]
pub struct BoundedQueue<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
    space: Condvar,
    capacity: usize,
}

/// The queue's contents, visible to consumers that pick several items at once (the batcher).
#[derive(Debug)]
pub struct State<T> {
    /// Items, oldest first.
    pub items: VecDeque<T>,
    /// No more pushes; consumers drain what is left, then stop.
    pub closed: bool,
}

impl<T> BoundedQueue<T> {
    /// A queue holding at most `capacity` items.
    pub fn new(capacity: usize) -> Self {
        BoundedQueue {
            state: Mutex::new(State {
                items: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
            space: Condvar::new(),
            capacity: capacity.max(1),
        }
    }

    /// The bound.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Items waiting now.
    pub fn len(&self) -> usize {
        self.lock().items.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues `item` unless the queue is full or closed; gives it back on failure.
    pub fn try_push(&self, item: T) -> Result<(), (PushError, T)> {
        let mut state = self.lock();
        if state.closed {
            return Err((PushError::Closed, item));
        }
        if state.items.len() >= self.capacity {
            return Err((PushError::Full, item));
        }
        state.items.push_back(item);
        drop(state);
        self.ready.notify_one();
        Ok(())
    }

    /// Queues `item`, waiting while the queue is full (back-pressure between stages); fails
    /// only when the queue is closed.
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut state = self.lock();
        while state.items.len() >= self.capacity && !state.closed {
            state = self.space.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        if state.closed {
            return Err(item);
        }
        state.items.push_back(item);
        drop(state);
        self.ready.notify_one();
        Ok(())
    }

    /// The oldest item, waiting for one; `None` once the queue is closed and drained.
    pub fn pop(&self) -> Option<T> {
        let mut state = self.lock();
        loop {
            if let Some(item) = state.items.pop_front() {
                drop(state);
                self.space.notify_one();
                return Some(item);
            }
            if state.closed {
                return None;
            }
            state = self.wait(state, None);
        }
    }

    /// Stops new pushes and wakes every consumer and blocked producer.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
        self.space.notify_all();
    }

    /// Locks the contents (for consumers that decide over several items).
    pub fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A consumer that panicked mid-update leaves a VecDeque that is still valid.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a push or close, at most until `deadline`.
    pub fn wait<'a>(
        &self,
        guard: MutexGuard<'a, State<T>>,
        deadline: Option<Instant>,
    ) -> MutexGuard<'a, State<T>> {
        match deadline {
            None => self.ready.wait(guard).unwrap_or_else(|e| e.into_inner()),
            Some(d) => {
                let timeout = d.saturating_duration_since(Instant::now());
                self.ready
                    .wait_timeout(guard, timeout)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn bounded_fifo_rejects_when_full_and_drains_after_close() {
        let q = BoundedQueue::new(2);
        q.try_push(1).unwrap();
        q.try_push(2).unwrap();
        assert_eq!(q.try_push(3), Err((PushError::Full, 3)));
        assert_eq!(q.pop(), Some(1));
        q.close();
        assert_eq!(q.try_push(4), Err((PushError::Closed, 4)));
        assert_eq!(q.pop(), Some(2));
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn consumers_on_several_threads_see_each_item_once() {
        let q = Arc::new(BoundedQueue::new(1000));
        let consumers: Vec<_> = (0..3)
            .map(|_| {
                let q = Arc::clone(&q);
                std::thread::spawn(move || std::iter::from_fn(|| q.pop()).collect::<Vec<u32>>())
            })
            .collect();
        for i in 0..1000 {
            q.try_push(i).unwrap();
        }
        q.close();
        let mut all: Vec<u32> = consumers
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
    }
}

//! Asks lost GPUs whether they answer again, on a thread of its own.
//!
//! A GPU that fell off the bus is exactly when NVML stalls: `device_by_uuid` and `memory_info`
//! may take seconds or never return. So [`DeviceSource::responds`] never runs on the async
//! runtime nor under the state lock: the state owner copies the lost GPUs out of the health book,
//! hands them to this thread ([`Prober::ask`]), keeps turning, and applies an answer
//! ([`Prober::poll`]) under the lock only once it came, through
//! [`crate::health::HealthBook::recover_answered`], which ignores marks newer than the question.
//! One round at a time: a hung probe delays recoveries, nothing else. The thread is not joined
//! at shutdown (a hung driver call must not keep the process from exiting).

use crate::inventory::DeviceUuid;
use crate::source::DeviceSource;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

/// One round's question: these GPUs, asked at this moment.
struct Question {
    gpus: Vec<DeviceUuid>,
    asked_at: Instant,
}

/// One round's answer: the GPUs of the question that answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub answered: Vec<DeviceUuid>,
    pub asked_at: Instant,
}

/// The probe thread's handle, owned by the state owner.
pub struct Prober {
    questions: Sender<Question>,
    answers: Receiver<Answer>,
    in_flight: bool,
    /// The thread ended (a source that panicked); no more rounds.
    gone: bool,
}

impl Prober {
    /// Starts the probe thread for `source`.
    pub fn start(source: Arc<dyn DeviceSource>) -> std::io::Result<Prober> {
        let (questions, asked) = mpsc::channel::<Question>();
        let (answer, answers) = mpsc::channel();
        std::thread::Builder::new()
            .name("gpuplane-probe".into())
            .spawn(move || {
                while let Ok(q) = asked.recv() {
                    let answered = q.gpus.into_iter().filter(|u| source.responds(u)).collect();
                    let a = Answer {
                        answered,
                        asked_at: q.asked_at,
                    };
                    if answer.send(a).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Prober {
            questions,
            answers,
            in_flight: false,
            gone: false,
        })
    }

    /// Starts a round for `gpus` unless one is still running (or there is nothing to ask).
    pub fn ask(&mut self, gpus: Vec<DeviceUuid>) {
        if self.in_flight || self.gone || gpus.is_empty() {
            return;
        }
        let q = Question {
            gpus,
            asked_at: Instant::now(),
        };
        match self.questions.send(q) {
            Ok(()) => self.in_flight = true,
            Err(_) => self.thread_gone(),
        }
    }

    /// The finished round's answer, if one finished since the last call.
    pub fn poll(&mut self) -> Option<Answer> {
        match self.answers.try_recv() {
            Ok(a) => {
                self.in_flight = false;
                Some(a)
            }
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => {
                self.thread_gone();
                None
            }
        }
    }

    fn thread_gone(&mut self) {
        if !self.gone {
            tracing::error!("the device probe thread ended; lost GPUs are no longer checked for recovery until the agent restarts");
        }
        self.gone = true;
        self.in_flight = false;
    }
}
